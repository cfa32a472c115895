import sys

from meridian.cli.main import main

sys.exit(main())
