from ptq_cli.cli import main

main()
