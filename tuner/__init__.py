"""tsdecode's tuner (``tsdecode-tune``): imports the runtime (``tsdecode``); the runtime never
imports this package.

  cli.py           the command line: tune (default), worker, export, create, explain, report
  parsers.py       the subcommands' flags and the glossary their help prints
  run.py           tune, worker, create, export: a run's pipeline, its closing lines, interrupts
  arguments.py     usage errors (exit code 2) and argument types shared by the subcommands
  grids.py         ShapeSpec (one benchmark case) and the named shape grids
  measure.py       input sets, a planned wrapper over them, bytes moved, CUDA-graph timing
  buckets.py       buckets (one study's shapes), a run's settings, a bucket's result and summary
  space.py         the search space of one bucket and the configs a study measures first
  runner.py        checking and timing candidates in a restartable worker; the compile pool
  study.py         output paths, the Optuna study storage (its run and queue locks), the results
                   log, workers' identities and their trials' retries
  search.py        the Tuner (one worker): one shared study per (problem class, bucket), re-timing
  job.py           a job in the storage: definition, GPU-model pin, progress, the table export
  devices.py       --devices: one worker process per device, compile processes per worker
  table_writer.py  merging entries into a device's table (atomic, locked)
  files.py         atomic writes (a killed process leaves no partial file) and copies aside
  report/          tsdecode-tune report: benchmark reports against baselines and peers
"""
