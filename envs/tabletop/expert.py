"""Scripted experts of the tabletop tasks: push the task's block to its goal, from the
simulator's privileged state (block positions, the goal), closed loop.

Each step the expert works out the push direction ``d`` from the block's current centre
``b`` to the goal point ``g`` (:meth:`TabletopEnv.goal_point`) and where the pusher ``p``
stands relative to the line through ``b`` along ``d``:

- behind the block and on the line (``|lateral| <= LINE_TOLERANCE``): push, i.e. move along
  ``d`` (slowing down near the goal) while steering back onto the line. A round pusher
  pushing a block off-centre turns and drifts it; re-aiming from the block's current centre
  every step corrects that (the closed-loop line-following of quasi-static pushing, cf.
  Lynch & Mason, 1996, "Stable Pushing: Mechanics, Controllability, and Planning").
- otherwise: go to the pre-push point ``b - PREPUSH * d``, around the blocks in the way
  (a detour point beside the first block that the straight path would touch).

The initial states of :mod:`~mmrl.envs.tabletop.tasks` keep every push path clear of other
blocks, so the expert never has to move a block out of the way.
"""

from __future__ import annotations

import numpy as np

from mmrl.envs.tabletop.env import CONTROL_DT, MAX_SPEED
from mmrl.envs.tabletop.tasks import BLOCK_HALF, PUSHER_LIMIT, PUSHER_RADIUS

PREPUSH = 0.065  # pre-push point behind the block's centre
CLEARANCE = BLOCK_HALF * np.sqrt(2) + PUSHER_RADIUS + 0.01  # pusher centre to block centre when going round
DETOUR = CLEARANCE + 0.015
SLACK = 0.008  # a segment may pass this much nearer a block than its nearer end (still clear of a rotated block)
LINE_TOLERANCE = 0.015
PUSH_STEP = 0.035  # pusher displacement per step while pushing
MAX_STEP = MAX_SPEED * CONTROL_DT


def expert_action(env, noise: float = 0.0, rng: np.random.Generator | None = None) -> np.ndarray:
    """The expert's action (float32 [2] in [-1, 1]) for the current state of a
    ``mmrl/Tabletop-v0`` env (wrapped or not). ``noise`` adds Gaussian noise of that standard
    deviation to the action (drawn from ``rng``), for more diverse demonstrations."""
    env = env.unwrapped
    pusher = env.pusher_position()
    blocks = env.block_positions()
    block, goal = blocks[env.target], env.goal_point()
    to_goal = goal - block
    distance = float(np.linalg.norm(to_goal))
    direction = to_goal / max(distance, 1e-9)
    normal = np.array([-direction[1], direction[0]])
    along, lateral = float((pusher - block) @ direction), float((pusher - block) @ normal)
    if -PREPUSH - 0.02 <= along <= -(BLOCK_HALF + PUSHER_RADIUS) + 0.01 and abs(lateral) <= LINE_TOLERANCE:
        step = min(PUSH_STEP, distance + 0.01)
        move = direction * step - normal * lateral
    else:
        move = _route(pusher, block - direction * PREPUSH, blocks) - pusher
    action = move / MAX_STEP
    action = action / max(1.0, float(np.abs(action).max()))  # saturate without turning off the planned path
    if noise > 0:
        action = action + noise * (rng if rng is not None else np.random.default_rng()).normal(size=2)
    return np.clip(action, -1.0, 1.0).astype(np.float32)


def _clear(starts: np.ndarray, ends: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Whether each segment (``starts``, ``ends`` broadcast to ``[...]``) keeps ``CLEARANCE``
    from every block, or, for a block nearer than that to one of its ends, gets at most
    ``SLACK`` nearer to it than both ends are."""
    path = ends - starts
    length2 = np.maximum(np.sum(path * path, -1), 1e-12)[..., None]
    rel = blocks - starts[..., None, :]  # [..., n, 2]
    t = np.clip(np.sum(rel * path[..., None, :], -1) / length2, 0.0, 1.0)
    closest = np.linalg.norm(rel - t[..., None] * path[..., None, :], axis=-1)
    allowed = np.minimum(CLEARANCE, np.minimum(np.linalg.norm(rel, axis=-1), np.linalg.norm(blocks - ends[..., None, :], axis=-1))) - SLACK
    return np.all(closest >= allowed, axis=-1)


_RING = np.stack([np.cos(np.arange(12) * np.pi / 6), np.sin(np.arange(12) * np.pi / 6)], 1) * DETOUR


def _route(pusher: np.ndarray, waypoint: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Where to head for now on the way to ``waypoint``: the first point of the shortest path
    through a visibility graph whose nodes are the pusher, the waypoint and twelve points
    around every block (moved inside the pusher's reach; those clear of all blocks), and
    whose edges are the :func:`_clear` segments between them."""
    if _clear(pusher, waypoint, blocks):
        return waypoint
    ring = np.clip((blocks[:, None, :] + _RING).reshape(-1, 2), -PUSHER_LIMIT + 0.005, PUSHER_LIMIT - 0.005)
    keep = np.linalg.norm(ring[:, None] - blocks, axis=-1).min(-1) >= CLEARANCE - SLACK
    nodes = np.concatenate([pusher[None], waypoint[None], ring[keep]])
    count = len(nodes)
    edges = _clear(np.broadcast_to(nodes[:, None], (count, count, 2)), np.broadcast_to(nodes[None], (count, count, 2)), blocks)
    weight = np.where(edges, np.linalg.norm(nodes[:, None] - nodes[None], axis=-1), np.inf)
    # Dijkstra from the pusher (node 0) to the waypoint (node 1)
    cost = np.full(count, np.inf)
    cost[0] = 0.0
    previous = np.full(count, -1)
    done = np.zeros(count, dtype=bool)
    for _ in range(count):
        i = int(np.argmin(np.where(done, np.inf, cost)))
        if not np.isfinite(cost[i]) or i == 1:
            break
        done[i] = True
        better = (cost[i] + weight[i] < cost) & ~done
        cost[better] = cost[i] + weight[i][better]
        previous[better] = i
    if previous[1] < 0:
        return waypoint  # no clear path: head straight for it
    node = 1
    while previous[node] != 0:
        node = previous[node]
    return nodes[node]
