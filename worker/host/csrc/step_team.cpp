// The step team's counters and test hook (step_team.h).

#include "kernels.h"
#include "step_team.h"

namespace conveyor {

TeamCounts& team_counts() {
  static TeamCounts counts;
  return counts;
}

TeamStall& team_stall() {
  static TeamStall stall;
  return stall;
}

std::tuple<int64_t, int64_t> step_team_counts() {
  const TeamCounts& c = team_counts();
  return {c.takeovers.load(), c.partner_tasks.load()};
}

void step_team_stall(int64_t every, int64_t micros) {
  TORCH_CHECK(every >= 0 && micros >= 0, "every and micros are >= 0");
  team_stall().micros.store(micros);
  team_stall().every.store(every);
}

}  // namespace conveyor
