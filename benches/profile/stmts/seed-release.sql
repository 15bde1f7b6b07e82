DELETE FROM leases WHERE name = $1 AND holder = $2
