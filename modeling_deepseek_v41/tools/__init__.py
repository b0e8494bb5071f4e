"""Command-line tools over the model package (the top of its layers: they may import any sub-package, and no
sub-package imports them): the memory plan of a configuration."""
