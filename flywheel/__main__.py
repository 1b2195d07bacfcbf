"""`python -m flywheel ...`: the console script, for subprocesses started with sys.executable."""

from flywheel.cli import main

main()
