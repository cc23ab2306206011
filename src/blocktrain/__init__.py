"""BlockTrain: train a byte-level language model as independently trainable diffusion blocks,
and serve the assembled model across hosts."""

__version__ = "0.1.0"
