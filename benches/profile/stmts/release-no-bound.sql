UPDATE "public"."pgwarden_leases" SET holder = '', expires_at = now() WHERE name = $1 AND holder = $2
