package server_test

import (
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stor-io/stor/internal/servertest"
)

// raftConnReaders counts the goroutines of raft's transport that serve an
// accepted connection (hashicorp/raft NetworkTransport.handleConn).
func raftConnReaders() int {
	buf := make([]byte, 8<<20)
	buf = buf[:runtime.Stack(buf, true)]
	n := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "raft.(*NetworkTransport).handleConn") {
			n++
		}
	}
	return n
}

// A closed server hangs up the Raft connections it dialed and those it
// accepted. Raft's transport closed only its listener, and each accepted
// connection's goroutine read on until the peer hung up, which a pooled
// connection's dialer never did: every closed cluster left its
// connections and their goroutines behind (two or more per server in a
// test binary, which also made hang reports name old clusters).
func TestClosedClusterLeavesNoRaftConnections(t *testing.T) {
	before := raftConnReaders()
	c := servertest.NewCluster(t, servertest.Options{})
	createVolume(t, c.Client(0), "v", gib, 3) // replication streams in use
	if n := raftConnReaders(); n <= before {
		t.Fatalf("%d raft connection readers with the cluster up, %d before: the test sees none of the cluster's", n, before)
	}
	c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		n := raftConnReaders()
		if n <= before {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d raft connection readers 10s after the cluster closed, %d before it started", n, before)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
