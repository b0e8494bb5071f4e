"""Configuration and the layer plan (the CSA2 schedule computed once from the config): the bottom of the package."""
