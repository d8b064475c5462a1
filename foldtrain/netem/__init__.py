"""An emulated multi-node network on one machine (root only): network namespaces joined by veth
links through a bridge, shaped with ``tc``. Used by ``foldtrain bench`` and ``foldtrain calibrate``.

``cluster`` builds and always tears down the namespaces; ``procs`` finds and stops the process
trees launched in them; ``netcheck`` is the small socket program run inside a namespace to check a link.
"""
