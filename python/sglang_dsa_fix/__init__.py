"""Fix, test and proof for the DSA/EAGLE req_to_token width bugs in SGLang (crash and row overflow)."""

__version__ = "0.3.0"
