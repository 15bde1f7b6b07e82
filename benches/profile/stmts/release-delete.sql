DELETE FROM "public"."pgwarden_leases" WHERE set_config('lock_timeout', '10000', true) IS NOT NULL AND name = $1 AND holder = $2
