import sys

from tramprof.commands.cli import main

sys.exit(main())
