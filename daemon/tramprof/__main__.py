import sys

from tramprof.cli import main

sys.exit(main())
