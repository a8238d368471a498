import sys

from flowalign.cli.main import main

sys.exit(main())
