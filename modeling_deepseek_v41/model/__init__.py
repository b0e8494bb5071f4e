"""The model classes: the pre-trained base (initialisation, from_pretrained), the backbone's forward, DSpark
drafting, generation and the causal-LM class."""
