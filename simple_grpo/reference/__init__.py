"""The reference server's parts (ref_server.py is the server): its flags (config.py), its HTTP side
(http_server.py) and the frozen model that adds log-probs (model.py)."""
