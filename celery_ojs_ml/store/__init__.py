"""Every Redis record and Lua script: registry, pending set, leader lock, leases, grants,
reservations, dead letters and the broker's Redis lists."""
