"""The step planner: which size each step takes so that its bin count divides by dp.

One job a module, each behind a small typed interface (docs/sampler.md, "The planner's parts"):

- `window`: where the stream stands (`StepContext`) and the sizes a step may take;
- `bounds`: the O(1) lower bound on a segment's bins (`SegmentBound`) and judges of whether a
  segment aligns (`BoundJudge`, remembered grids; `PairJudge`, real packer counts);
- `segments`: packing a prefix or segment, trying to reach a multiple of dp, memoised by content;
- `lookahead`: how many of the next steps can align after each size (`future_alignment`), or
  from each of the next step's end boundaries (`onward_alignment`);
- `search`: the exact and the bounded search, behind one `SizeSearch` interface;
- `floor`: where no size of any step ahead saves a bin, so a step evens its tokens instead;
- `deferral`: aligning by leaving a few examples for the next step;
- `padding`: ranking sizes that cannot align (their bins are rounded up by `dp_rounding`);
- `sizer`: `StepSizer`, which puts them together.

Pure numpy: no torch, no ranks, no files. The tuned constants it reads are `packing.tunables`
(`PlannerTunables`), one level down, which the hand-out and the packers' repair read too.
"""
