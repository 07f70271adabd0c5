import sys

from edgefcl.cli import main

if __name__ == "__main__":  # fleet processes re-import the main module (forkserver)
    sys.exit(main())
