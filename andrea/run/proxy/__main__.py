"""python -m andrea.run.proxy RUN_DIR: supervise the engine of one run (andrea.run.proxy.supervision)."""
import sys

from .supervision import main

sys.exit(main())
