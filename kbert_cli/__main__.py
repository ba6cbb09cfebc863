import sys

from kbert_cli import main

sys.exit(main())
