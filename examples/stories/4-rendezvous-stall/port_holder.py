"""A process left over from an earlier run: it holds PORT, accepts connections and never answers.

    python port_holder.py PORT     # prints "ready" once it listens
"""

import socket
import sys
import time

server = socket.socket()
server.bind(("0.0.0.0", int(sys.argv[1])))
server.listen(16)
print("ready", flush=True)
accepted = []  # keep them open: a peer that connected waits for an answer that never comes
while True:
    accepted.append(server.accept()[0])
    time.sleep(0)
