"""Services: plain typed functions returning dataclasses. No typer, no rich in here."""
