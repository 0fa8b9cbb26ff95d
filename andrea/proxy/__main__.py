"""python -m andrea.proxy RUN_DIR: supervise the engine of one run (andrea.proxy.supervision)."""
import sys

from .supervision import main

sys.exit(main())
