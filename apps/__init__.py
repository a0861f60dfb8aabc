"""Command-line programs of dflash2-mlx (installed as the package `dflash2_apps`)."""
