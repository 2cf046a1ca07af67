package replica

// runMap maps numbers (regions) to non-zero values, held as maximal runs
// [start, end) of one value in a skip list ordered by start; a number in
// no run has the value 0. Marking a range costs O(log n) plus the runs it
// meets, never the range's length, and the memory is O(runs): one
// request naming a million regions costs what one naming a single region
// does (the write history and the dirty-region log's touch times use it).
// Not safe for concurrent use; its owner guards it.
type runMap struct {
	head  runNode // sentinel: head.next[i] is the first node of level i
	level int     // levels in use (>= 1 once a node exists)
	n     int     // runs
	seed  uint64  // level generator state
}

type runNode struct {
	start, end, val uint64
	next            []*runNode
}

const runMaxLevel = 32

// path holds, per level, the last node before a position.
type runPath [runMaxLevel]*runNode

func (m *runMap) init() {
	if m.head.next == nil {
		m.head.next = make([]*runNode, runMaxLevel)
		m.seed = 0x9e3779b97f4a7c15
	}
}

// len returns the number of runs.
func (m *runMap) len() int { return m.n }

// before returns the last node whose start is < k (or &m.head), and fills
// p with the last such node on every level.
func (m *runMap) before(k uint64, p *runPath) *runNode {
	m.init()
	x := &m.head
	for i := runMaxLevel - 1; i >= 0; i-- {
		for x.next[i] != nil && x.next[i].start < k {
			x = x.next[i]
		}
		if p != nil {
			p[i] = x
		}
	}
	return x
}

func (m *runMap) randomLevel() int {
	// xorshift64; a level per two bits of randomness (p = 1/4).
	m.seed ^= m.seed << 13
	m.seed ^= m.seed >> 7
	m.seed ^= m.seed << 17
	lvl, r := 1, m.seed
	for lvl < runMaxLevel && r&3 == 0 {
		lvl++
		r >>= 2
	}
	return lvl
}

// insert adds run [s, e) = v after the nodes in p (p as filled by before(s)).
func (m *runMap) insert(p *runPath, s, e, v uint64) *runNode {
	lvl := m.randomLevel()
	x := &runNode{start: s, end: e, val: v, next: make([]*runNode, lvl)}
	for i := range lvl {
		x.next[i] = p[i].next[i]
		p[i].next[i] = x
	}
	m.n++
	return x
}

// remove unlinks x, the node after the nodes in p (p as filled by
// before(x.start)).
func (m *runMap) remove(p *runPath, x *runNode) {
	for i := range len(x.next) {
		if p[i].next[i] == x {
			p[i].next[i] = x.next[i]
		}
	}
	m.n--
}

// cut makes k a run boundary: a run straddling k is split in two.
func (m *runMap) cut(k uint64) {
	var p runPath
	x := m.before(k, &p)
	if x == &m.head || x.end <= k {
		return
	}
	end := x.end
	x.end = k
	// The new node goes right after x: x is the last node before k on
	// level 0, and p is where it links on every level.
	m.insert(&p, k, end, x.val)
}

// join merges the run ending at k with the run starting at k if they hold
// the same value.
func (m *runMap) join(k uint64) {
	var p runPath
	x := m.before(k, &p)
	y := x.next[0]
	if x == &m.head || y == nil || x.end != k || y.start != k || x.val != y.val {
		return
	}
	x.end = y.end
	// y is after the nodes in p on every level it has (x among them).
	m.remove(&p, y)
}

// get returns the value of k.
func (m *runMap) get(k uint64) uint64 {
	x := m.before(k+1, nil)
	if x != &m.head && k < x.end {
		return x.val
	}
	return 0
}

// covering returns the run holding all of [s, e), if one does.
func (m *runMap) covering(s, e uint64) *runNode {
	x := m.before(s+1, nil)
	if x != &m.head && x.end >= e {
		return x
	}
	return nil
}

// set gives [s, e) the value v (0 clears it).
func (m *runMap) set(s, e, v uint64) {
	if s >= e {
		return
	}
	// Fast paths, without allocating: the value is there already, or a
	// run is exactly [s, e) (a region written again).
	if x := m.covering(s, e); x != nil && (x.val == v || (x.start == s && x.end == e && v != 0)) {
		if x.val != v {
			x.val = v
			m.join(s)
			m.join(e)
		}
		return
	}
	m.cut(s)
	m.cut(e)
	var p runPath
	m.before(s, &p)
	for x := p[0].next[0]; x != nil && x.start < e; x = p[0].next[0] {
		m.remove(&p, x)
	}
	if v != 0 {
		m.insert(&p, s, e, v)
	}
	m.join(s)
	m.join(e)
}

// raise gives every number of [s, e) the value max(its value, v) and
// calls changed (if set) for each maximal piece whose value it raised.
func (m *runMap) raise(s, e, v uint64, changed func(s, e uint64)) {
	if s >= e || v == 0 {
		return
	}
	if x := m.covering(s, e); x != nil && x.val >= v {
		return // the common case: a region written again at its generation
	}
	m.cut(s)
	m.cut(e)
	// The runs of [s, e) and the gaps between them, in order; the runs
	// below v and the gaps become v.
	var stack [4][3]uint64
	pieces := stack[:0]
	var p runPath
	m.before(s, &p)
	pos := s
	for x := p[0].next[0]; x != nil && x.start < e; x = x.next[0] {
		if x.start > pos {
			pieces = append(pieces, [3]uint64{pos, x.start, 0})
		}
		pieces = append(pieces, [3]uint64{x.start, x.end, x.val})
		pos = x.end
	}
	if pos < e {
		pieces = append(pieces, [3]uint64{pos, e, 0})
	}
	for _, pc := range pieces {
		if pc[2] >= v {
			continue
		}
		m.set(pc[0], pc[1], v)
		if changed != nil {
			changed(pc[0], pc[1])
		}
	}
	m.join(s)
	m.join(e)
}

// each calls fn for each run, clipped to [s, e), in order, until fn
// returns false.
func (m *runMap) each(s, e uint64, fn func(s, e, v uint64) bool) {
	if s >= e {
		return
	}
	x := m.before(s+1, nil)
	if x == &m.head || x.end <= s {
		x = x.next[0]
	}
	for ; x != nil && x.start < e; x = x.next[0] {
		if !fn(max(x.start, s), min(x.end, e), x.val) {
			return
		}
	}
}

// all calls fn for every run in order until fn returns false.
func (m *runMap) all(fn func(s, e, v uint64) bool) {
	m.init()
	for x := m.head.next[0]; x != nil; x = x.next[0] {
		if !fn(x.start, x.end, x.val) {
			return
		}
	}
}
