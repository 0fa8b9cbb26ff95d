"""Files that survive a crash: atomic writes and run-folder locks."""
