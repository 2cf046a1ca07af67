package raftstore

import (
	"errors"
	"io"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// A server that has not joined (a wiped data dir, still a voter in the
// configuration) answers no vote and no pre-vote; joined, it is asked as
// any member. Other requests pass either way.
func TestAServerThatHasNotJoinedVotesForNoOne(t *testing.T) {
	newTrans := func() *raft.NetworkTransport {
		tr, err := raft.NewTCPTransport("127.0.0.1:0", nil, 2, time.Second, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tr.Close() })
		return tr
	}
	voter, candidate := newTrans(), newTrans()
	var member atomic.Bool
	done := make(chan struct{})
	defer close(done)
	gate := newMemberGate(voter, member.Load, done)
	// The voter's Raft: grants every request that reaches it.
	go func() {
		for {
			select {
			case <-done:
				return
			case rpc := <-gate.Consumer():
				switch rpc.Command.(type) {
				case *raft.RequestVoteRequest:
					rpc.Respond(&raft.RequestVoteResponse{Granted: true}, nil)
				case *raft.RequestPreVoteRequest:
					rpc.Respond(&raft.RequestPreVoteResponse{Granted: true}, nil)
				default:
					rpc.Respond(&raft.AppendEntriesResponse{Success: true}, nil)
				}
			}
		}
	}()
	ask := func() (vote, preVote, appended bool) {
		t.Helper()
		var v raft.RequestVoteResponse
		vErr := candidate.RequestVote("voter", voter.LocalAddr(), &raft.RequestVoteRequest{Term: 2}, &v)
		var p raft.RequestPreVoteResponse
		pErr := candidate.RequestPreVote("voter", voter.LocalAddr(), &raft.RequestPreVoteRequest{Term: 2}, &p)
		var a raft.AppendEntriesResponse
		if err := candidate.AppendEntries("voter", voter.LocalAddr(), &raft.AppendEntriesRequest{Term: 2, Entries: []*raft.Log{{Index: 1, Term: 2}}}, &a); err != nil {
			t.Fatalf("entries to the voter: %v", err)
		}
		if vErr != nil && !errors.Is(vErr, errNotJoined) && vErr.Error() != errNotJoined.Error() {
			t.Fatalf("vote: %v", vErr)
		}
		return vErr == nil && v.Granted, pErr == nil && p.Granted, a.Success
	}
	if vote, preVote, appended := ask(); vote || preVote || !appended {
		t.Errorf("before it joined: vote granted %v, pre-vote granted %v, entries taken %v; want no vote, no pre-vote, entries taken", vote, preVote, appended)
	}
	member.Store(true)
	if vote, preVote, appended := ask(); !vote || !preVote || !appended {
		t.Errorf("once joined: vote granted %v, pre-vote granted %v, entries taken %v; want all", vote, preVote, appended)
	}
}
