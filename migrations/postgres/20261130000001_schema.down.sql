DROP FUNCTION IF EXISTS sluice_due_at(bigint, bigint, bigint, integer, integer, integer);
DROP TABLE IF EXISTS sluice_jobs;
DROP TABLE IF EXISTS sluice_destinations;
DROP FUNCTION IF EXISTS sluice_now_us();
