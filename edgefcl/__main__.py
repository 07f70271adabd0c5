import sys

from edgefcl.cli import main

sys.exit(main())
