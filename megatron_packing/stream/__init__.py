"""From plans to a resumable stream of steps, shared by the packed and the padded mode.

- `base_order`: the epoch's example order, a cursor that resumes over any base sampler;
- `step_stream`: batch samplers whose iterators own their cursor;
- `state_checks`: refusals of an empty, partial, tampered or other-setup sampler state;
- `fetch`: a rank's planned examples fetched with the plan attached.
"""
