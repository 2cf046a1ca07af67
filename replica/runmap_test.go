package replica

import (
	"fmt"
	"math/rand"
	"testing"
)

// TestRunMapModel drives a runMap with random set and raise operations
// and checks it after each against a plain array: every value, maximal
// runs, and the pieces raise reports as changed.
func TestRunMapModel(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewSource(seed))
	const size = 300
	for round := range 20 {
		var m runMap
		model := make([]uint64, size)
		for step := range 400 {
			s := uint64(rng.Intn(size))
			e := s + 1 + uint64(rng.Intn(min(size-int(s), 1+rng.Intn(60))))
			v := uint64(rng.Intn(5))
			if rng.Intn(2) == 0 {
				m.set(s, e, v)
				for i := s; i < e; i++ {
					model[i] = v
				}
			} else {
				changed := make([]bool, size)
				m.raise(s, e, v, func(cs, ce uint64) {
					for i := cs; i < ce; i++ {
						if changed[i] {
							t.Fatalf("seed %d round %d step %d: region %d reported changed twice", seed, round, step, i)
						}
						changed[i] = true
					}
				})
				for i := s; i < e; i++ {
					if v > model[i] {
						model[i] = v
						if !changed[i] {
							t.Fatalf("seed %d round %d step %d: raise(%d, %d, %d) did not report region %d", seed, round, step, s, e, v, i)
						}
						changed[i] = false
					}
				}
				for i, c := range changed {
					if c {
						t.Fatalf("seed %d round %d step %d: raise(%d, %d, %d) reported region %d, which did not change", seed, round, step, s, e, v, i)
					}
				}
			}
			checkRunMap(t, &m, model, func() string {
				return fmt.Sprintf("seed %d round %d step %d", seed, round, step)
			})
		}
	}
}

func checkRunMap(t *testing.T, m *runMap, model []uint64, where func() string) {
	t.Helper()
	for i, want := range model {
		if got := m.get(uint64(i)); got != want {
			t.Fatalf("%s: get(%d) = %d, want %d", where(), i, got, want)
		}
	}
	runs := 0
	var prevEnd, prevVal uint64
	m.all(func(s, e, v uint64) bool {
		if s >= e || v == 0 || (runs > 0 && (s < prevEnd || (s == prevEnd && v == prevVal))) {
			t.Fatalf("%s: run [%d, %d) = %d after [.., %d) = %d: not maximal and ordered", where(), s, e, v, prevEnd, prevVal)
		}
		for i := s; i < e; i++ {
			if model[i] != v {
				t.Fatalf("%s: run [%d, %d) = %d, model[%d] = %d", where(), s, e, v, i, model[i])
			}
		}
		prevEnd, prevVal = e, v
		runs++
		return true
	})
	if runs != m.len() {
		t.Fatalf("%s: %d runs, len %d", where(), runs, m.len())
	}
	// each clips to its range.
	s, e := uint64(len(model)/3), uint64(2*len(model)/3)
	covered := make([]uint64, len(model))
	m.each(s, e, func(rs, re, v uint64) bool {
		if rs < s || re > e {
			t.Fatalf("%s: each(%d, %d) gave [%d, %d)", where(), s, e, rs, re)
		}
		for i := rs; i < re; i++ {
			covered[i] = v
		}
		return true
	})
	for i := s; i < e; i++ {
		if covered[i] != model[i] {
			t.Fatalf("%s: each(%d, %d) gave %d for %d, want %d", where(), s, e, covered[i], i, model[i])
		}
	}
}

// TestRunMapLongRangeCostsOneRun: marking a huge range is one run, made
// with a few allocations, whatever its length.
func TestRunMapLongRangeCostsOneRun(t *testing.T) {
	var m runMap
	m.raise(10, 20, 1, nil)
	allocs := testing.AllocsPerRun(10, func() {
		m.raise(0, 1<<40, 2, nil)
		m.set(1<<39, 1<<40, 3)
		m.set(0, 1<<40, 0)
	})
	if allocs > 20 || m.len() != 0 {
		t.Fatalf("%v allocations per round, %d runs left", allocs, m.len())
	}
}

// TestSetBits checks setBits against setting bit by bit.
func TestSetBits(t *testing.T) {
	for a := uint64(0); a < 40; a++ {
		for b := a; b <= 40; b++ {
			got := make([]byte, 5)
			setBits(got, a, b)
			want := make([]byte, 5)
			for i := a; i < b; i++ {
				want[i/8] |= 1 << (i % 8)
			}
			if string(got) != string(want) {
				t.Fatalf("setBits(%d, %d) = %08b, want %08b", a, b, got, want)
			}
		}
	}
}
