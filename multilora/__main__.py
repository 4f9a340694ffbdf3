import sys

from multilora.cli import main

sys.exit(main())
