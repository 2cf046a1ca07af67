package e2etest

import "testing"

// freePorts never hands out a port twice in one test binary, though it
// releases each before the next call (its servers bind them later).
func TestFreePortsNeverRepeat(t *testing.T) {
	seen := map[int]bool{}
	for range 200 { // 600 ports: many times a test binary's servers
		for _, p := range freePorts(t, 3) {
			if seen[p] {
				t.Fatalf("port %d handed out twice", p)
			}
			seen[p] = true
		}
	}
}
