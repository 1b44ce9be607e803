"""Rank 0 proves MASTER_PORT is free by binding it."""
import os
import socket

if os.environ["RANK"] == "0":
    with socket.socket() as s:
        s.bind(("0.0.0.0", int(os.environ["MASTER_PORT"])))
    print("bound", os.environ["MASTER_PORT"])
