"""`python -m peagle ...` is the same as the `peagle` command."""

from peagle.cli import main

main()
