DELETE FROM "public"."pgwarden_leases" WHERE name = $1 AND holder = $2
