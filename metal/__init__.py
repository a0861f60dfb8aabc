"""The Metal kernel bodies of dflash2-mlx (installed as the package `dflash2_metal`; loaded by
`dflash2_mlx.kernels`)."""
