"""The reference server's parts (ref_server.py is the server; its flags, ServerConfig, are in protocol.py and the
frozen model's loading, load_reference, in logprobs.py): its HTTP side (http_server.py), and which model it serves
(fingerprint.py)."""
