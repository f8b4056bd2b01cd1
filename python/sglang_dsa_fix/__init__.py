"""Fix, verdict, test and proof for SGLang's req_to_token width bugs under speculative decoding."""

__version__ = "0.4.0"
