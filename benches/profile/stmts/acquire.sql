INSERT INTO "public"."pgwarden_leases" AS l (name, holder, token, taken_at, expires_at, renewed_at)
SELECT $1, $2, nextval('"public"."pgwarden_leases_token_seq"'), now(), now() + make_interval(secs => $3), now()
  FROM (SELECT (SELECT c.expires_at >= now() OR c.held_until > now() FROM "public"."pgwarden_leases" c WHERE c.name = $1) AS live OFFSET 0) AS s
 WHERE s.live IS NOT TRUE
   AND set_config('lock_timeout', CASE WHEN s.live IS NULL THEN '10000' ELSE '20' END, true) IS NOT NULL
ON CONFLICT (name) DO UPDATE
   SET name = excluded.name, holder = excluded.holder, token = nextval('"public"."pgwarden_leases_token_seq"'),
       taken_at = excluded.taken_at, expires_at = excluded.expires_at,
       held_until = excluded.held_until, prev_holder = l.holder, renewed_at = now()
 WHERE l.expires_at < now() AND l.held_until <= now()
RETURNING l.token, l.prev_holder, date_part('epoch', l.taken_at)
