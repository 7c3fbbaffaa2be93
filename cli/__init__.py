"""The ``traind`` command line and its HTTP clients of the daemon's API.

A client, not the daemon: no module here imports the database engine or the web layer (a
test imports each in a fresh interpreter to check). The one way in is ``traind serve``, which
builds the daemon's composition root lazily inside its command.
"""
