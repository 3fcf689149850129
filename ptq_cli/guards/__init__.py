"""What stands between ptq and the files and signals people hand it: writes through a temporary file (atomic),
reads within bounds (bounded), no code run from a file ptq did not write (trust, cache), a stop that always
stops (hardstop), native libraries kept quiet (library_noise)."""
