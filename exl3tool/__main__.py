"""`python -m exl3tool` == the `exl3tool` console script."""

from exl3tool.cli import main

main()
