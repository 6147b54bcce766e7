"""The reference server's parts (ref_server.py is the server): its flags and the frozen model they load
(config.py), its HTTP side (http_server.py), and which model it serves (fingerprint.py)."""
