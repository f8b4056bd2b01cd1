"""Fix, test and proof for the DSA CUDA-graph page_table width crash in SGLang 0.5.4 - 0.5.14."""

__version__ = "0.1.0"
