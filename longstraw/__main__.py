import sys

from longstraw.cli import main

sys.exit(main())
