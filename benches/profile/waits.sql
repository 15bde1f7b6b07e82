CREATE OR REPLACE FUNCTION pgw_sample_waits(secs float8, dt float8)
RETURNS TABLE (datname name, state text, wait text, samples bigint) LANGUAGE plpgsql AS $$
DECLARE t0 timestamptz := clock_timestamp(); k bigint := 0;
BEGIN
  CREATE TEMP TABLE IF NOT EXISTS pgw_s (d name, st text, w text);
  TRUNCATE pgw_s;
  WHILE clock_timestamp() < t0 + make_interval(secs => secs) LOOP
    PERFORM pg_stat_clear_snapshot();
    INSERT INTO pgw_s
      SELECT a.datname, a.state, coalesce(a.wait_event_type || ':' || a.wait_event, 'CPU')
        FROM pg_stat_activity a
       WHERE a.backend_type = 'client backend' AND a.pid <> pg_backend_pid()
         AND a.datname NOT IN ('postgres');
    k := k + 1;
    PERFORM pg_sleep(dt);
  END LOOP;
  RETURN QUERY SELECT d, st, w, count(*) FROM pgw_s GROUP BY 1, 2, 3
    UNION ALL SELECT '#samples'::name, '', '', k ORDER BY 1, 4 DESC;
END $$;
