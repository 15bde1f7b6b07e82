UPDATE "public"."pgwarden_leases" SET holder = '', expires_at = now() WHERE set_config('lock_timeout', '10000', true) IS NOT NULL AND name = $1 AND holder = $2
