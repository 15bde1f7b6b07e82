INSERT INTO "public"."pgwarden_leases" AS l (name, holder, token, taken_at, expires_at)
SELECT $1, $2, 0, now(), now() + make_interval(secs => $3)
ON CONFLICT (name) DO UPDATE
   SET name = excluded.name, holder = excluded.holder, token = 0,
       taken_at = excluded.taken_at, expires_at = excluded.expires_at,
       held_until = excluded.held_until, prev_holder = l.holder
 WHERE l.expires_at < now() AND l.held_until <= now()
RETURNING l.token
