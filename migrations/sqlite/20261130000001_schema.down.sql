DROP TABLE IF EXISTS sluice_jobs;
DROP TABLE IF EXISTS sluice_destinations;
