"""Pure tensor functions, one module per stage of the sampling pipeline."""
