import sys

from mmrl.cli import main

sys.exit(main())
